"""Jupyter's side of kernelhub: the pure message translation the gateway's ``/api`` serves
(``messages``), and the client pieces (``bridge``, ``provisioner``) that let stock
jupyter_client, nbclient and ``jupyter console`` run against a gateway's sessions."""
