"""Front ends over the engine: the HTTP server and the runtime command line.

`stallfree.runtime` never imports this package; these modules only use the engine's public API.
"""
