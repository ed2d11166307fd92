"""Unit tests for cluster operations: job submission request, metrics plugin, autoscaler config."""
