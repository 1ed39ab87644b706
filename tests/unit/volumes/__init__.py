"""The driver volume's pure parts (volumes/)."""
