"""From-scratch training behind ``bayescli train``: the plain classifier trainer
(:mod:`bayescli.training.classifier`) and one module per VI method that can train a builtin
network with its own objective (``train`` in each; registered in :mod:`bayescli.fitting.registry`).

Post-hoc fitting lives with the posteriors (:mod:`bayescli.posterior`); this layer sits above
them and may reuse their objectives, never the other way round.
"""
