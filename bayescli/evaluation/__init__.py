"""Evaluation suites (in-distribution, OOD, rotation, corruption, FGSM), reports and CI gates."""
