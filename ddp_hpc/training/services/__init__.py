"""The Trainer's periodic services, each a ``Callback``: tracking, early stopping, the
background prestage and the weights check. (The checkpoint cadence, the deadline stop and
the watchdog are the engine's parts, which the Trainer uses as a loop of one's own does.)"""
