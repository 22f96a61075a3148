"""The golden AMI pipeline: bake with Packer, publish to SSM and cluster configs, rebuild, prune."""
