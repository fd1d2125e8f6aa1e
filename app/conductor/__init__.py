"""The request's path through the engines: the conductor (lifecycle, routing, failover), the PDD
relay, the prefix index, the engine client, journeys, and the readiness of roles."""
