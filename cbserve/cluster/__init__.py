"""Ray: the Serve ingress, the engine client and router, the SchedulerActor and WorkerActors, the Ray executor,
the one user configuration (CBServeConfig), metrics export and the ``cbserve`` CLI."""
