"""Ray: the Serve ingress, the engine client and router, the SchedulerActor and WorkerActors, the Ray executor,
metrics export and the ``cbserve`` CLI (the configuration they read is ``cbserve.config``)."""
