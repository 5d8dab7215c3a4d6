"""Beyond one device: meshes and sharding rules (`mesh`), multi-host start-up (`distributed`).

Modules are imported by name (`from specjax.parallel import mesh`); this package re-exports nothing, so that
importing it starts no backend.
"""
