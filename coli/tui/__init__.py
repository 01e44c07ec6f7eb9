"""The Textual front end of `coli chat`: app, panes, and their pure data models."""
