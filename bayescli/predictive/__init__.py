"""Predictives, links, the Laplace bridge with Dirichlet utilities, and uncertainty-aware top-k."""
