"""The swarm simulator (issue 5): not built yet."""
