"""How a rank's weighted gradient and telemetry reach the others: weights, transports, the hook."""
