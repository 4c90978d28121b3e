"""The paper's experiments: problems, runners, reporting.  ``drmoo`` on the command line drives them."""
