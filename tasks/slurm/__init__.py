"""The train stage as a SLURM batch job (`distributed.launcher: slurm`): the script
(`script`), SLURM's commands (`commands`), and the job the stage submits and follows (`job`)."""
