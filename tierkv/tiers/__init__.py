"""Storage tiers, each a ``base.Tier``: the memory pools (``gpu.GpuTier``, ``host.HostTier``, both a
``pool.BlockPool``), the disk (``disk.DiskTier``), the remote one (``remote.RemoteTier``) and the
``admission.Admission`` wrapper. Import the modules themselves: this package exports nothing."""

__all__: list[str] = []
