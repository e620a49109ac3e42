"""beamserve.router.api."""
