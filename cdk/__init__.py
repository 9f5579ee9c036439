"""The Sluice CDK app: one stack per worker backend, built from constructs."""
