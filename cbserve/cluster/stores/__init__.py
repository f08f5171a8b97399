"""The app's state shared by its replicas: the LoRA adapters and the stored responses, each kept by a detached actor."""
