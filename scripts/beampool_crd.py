"""Write the BeamPool CRD (beamserve.operator.scaler) into the chart's crds/ (`make crd`)."""

from pathlib import Path

from beamserve.operator import scaler

out = Path(__file__).resolve().parents[1] / "charts" / "beamserve" / "crds"
(out / f"{scaler.CRD_NAME}.yaml").write_text(scaler.scaler_crd_yaml())
