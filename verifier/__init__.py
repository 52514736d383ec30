"""Third-party verification of receipts: reconstruct the deployment and tuple, re-execute, compare bits."""
