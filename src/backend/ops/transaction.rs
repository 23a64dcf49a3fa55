//! `TransactionOps` of `Amp<B>`: a batched read, counted as one host read.

use burn_backend::ops::{TransactionOps, TransactionPrimitive, TransactionPrimitiveData};
use burn_backend::{Backend, ExecutionError};

use crate::backend::Amp;

impl<B: Backend> TransactionOps<Self> for Amp<B> {
    fn tr_execute(
        transaction: TransactionPrimitive<Self>,
    ) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
        crate::backend::count_host_read();
        // `execute_async` has taken the read order out already; the inner backend only
        // sees the four lists, so they can be moved over as they are.
        B::tr_execute(TransactionPrimitive::new(
            transaction.read_floats,
            transaction.read_qfloats,
            transaction.read_ints,
            transaction.read_bools,
        ))
    }
}
