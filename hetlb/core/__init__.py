"""Pure parts (numpy and the extension): time models, solvers, telemetry records, decisions."""
