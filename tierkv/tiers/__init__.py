"""Storage tiers: host RAM (``host.HostTier``) and disk (``disk.DiskTier`` over ``segments``)."""
