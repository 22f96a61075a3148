"""`gpuforge fleet`: changes in place on a running cluster's nodes through AWS Systems Manager Run Command."""
