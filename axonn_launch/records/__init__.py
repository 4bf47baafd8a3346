"""Reading what a job left behind: its status and failure class, and which rank failed first."""
