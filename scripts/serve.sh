#!/usr/bin/env bash
# The main command: from a fresh clone to a running OpenAI-compatible server with the embedded default
# model (creates .venv, installs, runs `tierkv serve`). Extra arguments go to `tierkv serve`
# (e.g. --model /path/to/hf-model --port 8000 --cache-dir /var/cache/tierkv).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh serve 2> >(grep -v "is ignored: it is neither" >&2)
port=8000
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--port" ] && port="${args[$((i + 1))]}"
done
cat <<MSG
tierkv: starting on http://127.0.0.1:${port}  (Ctrl-C or SIGTERM stops it cleanly)
Try, in another shell (send it twice: the second reports cached_tokens):
  curl -s http://127.0.0.1:${port}/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "messages": [{"role": "system", "content": "$(printf 'You are a helpful assistant. %.0s' {1..12})"},
                 {"role": "user", "content": "Hello!"}], "max_tokens": 16}' | python3 -m json.tool
Metrics: http://127.0.0.1:${port}/metrics   Store: .venv/bin/tierkv stats
MSG
exec .venv/bin/tierkv serve "$@"
