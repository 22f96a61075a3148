"""`gpuforge accept`: prove a Slurm cluster before anyone trains on it, and take the bad nodes out."""
