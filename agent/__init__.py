"""The node agent: telemetry, risk and TTFK, MPS caps, withholding, local API, metrics (gpushare.agent)."""
