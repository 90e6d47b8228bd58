"""What the tests (tests/) and the benches (bench/) share, kept out of raychat itself: a local S3
server and a fault-injecting proxy in front of it, the stopping of a local Ray cluster's processes,
the drivers' lease race, and the audits and readers of a run's trace, logs and reports that a bench
measures with and a test checks. raychat never imports it; tests import it, never bench/."""
