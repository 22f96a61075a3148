"""The local lab: real Debian hosts (systemd-nspawn in network namespaces) plus moto as EC2."""
