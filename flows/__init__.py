"""Prefect orchestration only: flows call the stage tasks; no pipeline logic lives here."""
