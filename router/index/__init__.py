"""beamserve.router.index."""
