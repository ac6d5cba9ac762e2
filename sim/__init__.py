"""The swarm simulator: topology files and presets, and a seeded discrete-event engine that
runs the coordinator's own estimator, scheduler and re-plan rules on thousands of peers."""
