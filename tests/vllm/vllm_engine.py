"""Helpers of the vLLM connector tests: one engine process per run, and the tierkv CLI beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def tierkv_python() -> str:
    """The main venv's interpreter for the tierkv CLI (what an operator runs beside vLLM), else this one."""
    main = ROOT / ".venv" / "bin" / "python"
    return str(main) if main.exists() else sys.executable


def tierkv_cli(*args: str) -> dict:
    r = subprocess.run(
        [tierkv_python(), "-m", "tierkv.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"tierkv {' '.join(args)}: {r.stderr[-2000:]}"
    return json.loads(r.stdout)


class Engine:
    """Runs ``vllm_run.py`` (one vLLM engine process) and returns its result; the log is kept beside."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir = workdir
        self.model = model

    def run(self, name: str, prompts: list[dict], connector: dict | None, **spec: object) -> dict:
        return self.wait(self.start(name, prompts, connector, **spec))

    def start(
        self, name: str, prompts: list[dict], connector: dict | None, **spec: object
    ) -> tuple[str, subprocess.Popen]:
        """Starts the run in the background (``wait`` for its result): several engines at once."""
        spec_path = self.workdir / f"{name}.spec.json"
        result_path = self.workdir / f"{name}.result.json"
        log_path = self.workdir / f"{name}.log"
        spec_path.write_text(
            json.dumps(
                {
                    "model": str(self.model),
                    "prompts": prompts,
                    "connector": connector,
                    "max_tokens": 8,
                    "logprobs": 1,
                    **spec,
                }
            )
        )
        env = dict(
            os.environ,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "vllm_run.py"), str(spec_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
            )
        return name, proc

    def wait(self, started: tuple[str, subprocess.Popen]) -> dict:
        name, proc = started
        log_path = self.workdir / f"{name}.log"
        result_path = self.workdir / f"{name}.result.json"
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        tail = log_path.read_text()[-4000:]
        assert rc == 0, f"vLLM run {name} failed:\n{tail}"
        result = json.loads(result_path.read_text())
        result["log"] = log_path.read_text()
        return result
