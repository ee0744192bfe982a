"""``tierkv bench``: cold prefill against restore from each tier, tier bandwidth against the hardware's
limit, real workloads through the HTTP server, and the break-even plan. Every ratio is against a
baseline measured in the same run.

Modules: ``tiers`` (bandwidth), ``ttft`` (time to first token), ``workloads`` (HTTP), ``plan``
(break-even), ``report`` (JSON, markdown, plots), ``machine`` (what it ran on, dropping the page cache).
"""
