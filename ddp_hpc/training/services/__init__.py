"""The Trainer's periodic services, each a ``Callback``: tracking, early stopping, the
watchdog, the background prestage, the deadline stop and the weights check."""
