"""tierkv under other inference engines.

    vllm/        ``TierKVConnector``, a vLLM KV connector (v1 API): vLLM's scheduler looks prompts up in a
                 tierkv store, its workers load hit blocks into the paged KV cache and save computed ones;
                 and ``vllm/serve.py``, ``serve_vllm``: vLLM's OpenAI server started with that connector

Nothing here is imported by the rest of tierkv; each module needs its engine installed.
"""

__all__: list[str] = []
