"""The cgroup modules' pure parts and the cpuset edge on a temporary tree."""
