"""The daemon (isolator/daemon/): its configuration, its option table and its periodic jobs."""
