"""beamserve.router.flow."""
