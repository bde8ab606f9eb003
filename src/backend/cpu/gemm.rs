//! The CPU matrix product: a safe, checked wrapper over the `gemm` crate,
//! whose API takes raw pointers. This is the backend's only unsafe code.

use super::numeric::Accum;
use crate::error::{Error, Result};

/// `dst = lhs @ rhs`, all row-major: `lhs` is m×k, `rhs` k×n, `dst` m×n.
pub fn matmul<A: Accum>(m: usize, k: usize, n: usize, lhs: &[A], rhs: &[A], dst: &mut [A]) -> Result<()> {
    if lhs.len() != m * k || rhs.len() != k * n || dst.len() != m * n {
        return Err(Error::Internal(format!(
            "matmul of {m}x{k} by {k}x{n}: got {} lhs, {} rhs and {} dst elements",
            lhs.len(),
            rhs.len(),
            dst.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst.fill(A::default());
        return Ok(());
    }
    // SAFETY: the lengths were checked above against the row-major strides
    // given here, so every access stays inside the three slices; `dst` is a
    // unique borrow, so it aliases neither input. A is f32 or f64, both of
    // which `gemm` supports (it panics on other types, never reached).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            1,
            n as isize,
            A::default(),
            A::one(),
            false,
            false,
            false,
            // Each device call runs on its own thread already.
            gemm::Parallelism::None,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product() {
        let (m, k, n) = (5, 13, 7);
        let lhs: Vec<f64> = (0..m * k).map(|i| ((i * 7 % 11) as f64) - 5.0).collect();
        let rhs: Vec<f64> = (0..k * n).map(|i| ((i * 5 % 13) as f64) * 0.5 - 3.0).collect();
        let mut dst = vec![f64::NAN; m * n];
        matmul(m, k, n, &lhs, &rhs, &mut dst).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|p| lhs[i * k + p] * rhs[p * n + j]).sum();
                assert!((dst[i * n + j] - want).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn wrong_lengths_are_an_error_not_a_crash() {
        let mut dst = vec![0f32; 4];
        assert!(matmul(2, 3, 2, &[0.0; 5], &[0.0; 6], &mut dst).is_err());
    }

    #[test]
    fn empty_contraction_gives_zeros() {
        let mut dst = vec![1f32; 6];
        matmul(2, 0, 3, &[], &[], &mut dst).unwrap();
        assert!(dst.iter().all(|&v| v == 0.0));
    }
}
