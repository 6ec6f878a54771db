"""Reading raw sources: files, directories, globs and URLs, their formats, and record validation."""
