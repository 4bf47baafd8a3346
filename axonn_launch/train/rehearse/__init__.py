"""Rehearsals of a job's ranks on this computer: ``rank.py`` runs one real rank of the job
at its full world size with torch's fake process group (``rehearse=rank``)."""
