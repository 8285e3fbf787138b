"""Variational posteriors (../shared/VI-SPEC.md): MNVI, FSVI, Dirichlet fVI."""
