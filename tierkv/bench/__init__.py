"""``tierkv bench``: cold prefill against restore from each tier, tier bandwidth against the hardware's
limit, real workloads through the HTTP server, and the break-even plan. Every ratio is against a
baseline measured in the same run.

Modules: ``tiers`` (bandwidth), ``ttft`` (time to first token), ``workloads`` (HTTP), ``restart`` (a long
prompt across a server restart), ``scaleout`` (two workers), ``plan`` (break-even), ``report`` (JSON,
markdown, plots, over the parts), ``serving`` (server and router subprocesses), ``table`` (markdown tables),
``machine`` (what it ran on, dropping the page cache).
"""

__all__: list[str] = []
