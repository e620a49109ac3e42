"""beamserve: Kubernetes-native, disaggregated serving for the Beam model."""

__version__ = "0.1.0"
