"""Parts of the API shared by every framework adapter."""
