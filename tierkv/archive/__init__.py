"""Moving a cache between stores: ``tierkv export`` and ``tierkv import`` (and the server's
``GET /admin/export``). ``frames`` is the format, ``export`` writes it from a disk tier, ``load`` reads it
into one, verifying every record on the way in, ``streams`` moves its bytes."""

__all__: list[str] = []
