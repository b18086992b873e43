"""The cluster's parts, behind `cluster.ClusterController` (cluster.py): building it from the config
(build.py), its state (state.py), the clock adapter (clock_feed.py) and the round driver (round_driver.py)."""
