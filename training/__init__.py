"""r4t offline job: catalog, index, benchmark, stage 1 (FOLM + GRPO), stage 2 (synthesis),
stage 3 (diffusion), evaluation. Imports the service runtime; never imported by it."""
