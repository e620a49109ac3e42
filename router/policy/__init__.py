"""beamserve.router.policy."""
