"""The local runtime: a `BeamDeployment` as processes on this machine (`beamserve up`).

`plan` maps the operator's desired objects onto processes (pure); `stack.LocalStack` runs
them; `cli` holds `beamserve up`, `down` and `status`.
"""
