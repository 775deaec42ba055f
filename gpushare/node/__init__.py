"""What the node agent, the Prolog and the Epilog share about a job on its node: the job store, the caps and
the caps file, registration and the final record, the AdminComment summary, the hook environment, the hard
cap's files, the agent's socket client and paths, and the node feature that withholds shared jobs."""
